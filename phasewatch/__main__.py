from phasewatch.trainers.cli import console_main

console_main()
