"""What every page phasewatch writes shares, so that a run folder's strings stay text.

A run folder is data from anyone, and its strings (metric keys, event fields, labels, config
values, folder names) are shown. Each page escapes every string it templates (`html.escape`)
and its script shows strings with `textContent` only; embeds its data with `script_json` (`<`,
`>`, `&` as `\\u` escapes: no string closes the block); and carries `policy`, a
Content-Security-Policy under which nothing loads and only the page's own script runs (by its
SHA-256). `load_array` reads a run folder's .npy arrays without unpickling them (ConfigError,
one line, for anything but a plain array). docs/report.md, "Safety": why.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from phasewatch.errors import ConfigError


def script_hash(script: str) -> str:
    """The CSP source that allows exactly this inline script (its text between the tags)."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode() + "'"


def policy(*scripts: str) -> str:
    """The page's Content-Security-Policy as a <meta> tag (first in <head>, before any script):
    only `scripts` run, inline styles and `data:` images are allowed, nothing else is loaded."""
    sources = ["default-src 'none'", "img-src data:", "style-src 'unsafe-inline'", "base-uri 'none'",
               "form-action 'none'"]
    if scripts:
        sources.insert(1, "script-src " + " ".join(map(script_hash, scripts)))
    return f'<meta http-equiv="Content-Security-Policy" content="{"; ".join(sources)}">'  # no " or & in it


def script_json(data: Any) -> str:
    """`data` as JSON to embed in a <script type="application/json"> block: `<`, `>` and `&`
    as `\\u003c`, `\\u003e`, `\\u0026` (outside strings JSON has none of them), so that no
    string in it reads as `</script>` or `<!--` to the HTML parser; JSON.parse gives it back."""
    text = json.dumps(data, allow_nan=False, default=float)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def load_array(path: str | Path) -> np.ndarray:
    """A run folder's .npy array, never unpickled. ConfigError (one line: the file and what to
    do) when it holds pickled objects or is no .npy at all."""
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as err:
        if "allow_pickle" in str(err):
            raise ConfigError(str(path), "holds pickled Python objects (an object array), which phasewatch "
                              "never loads: unpickling runs code",
                              "Save it as a numeric or string array (np.save(path, np.asarray(values, dtype=float))), "
                              "or delete the file, then run the command again.") from None
        raise ConfigError(str(path), f"is not a readable .npy array ({err})",
                          "Delete the file or write it again with np.save, then run the command again.") from None
    except (OSError, EOFError) as err:
        raise ConfigError(str(path), f"cannot be read as a .npy array ({err})",
                          "Delete the file or write it again with np.save, then run the command again.") from None
