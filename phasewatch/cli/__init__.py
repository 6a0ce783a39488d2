"""The command line: the dispatcher (main.py) and one module per command."""
