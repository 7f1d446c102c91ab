"""numba imported without importing PyYAML or importlib.metadata, which it uses only when it needs them.

numba.core.config imports yaml at its import (0.015 s of a second process's ~0.6 s to its first token on the
2-core machine: yaml's reader, scanner and constructors) and uses it in one place: reading
`.numba_config.yaml` from the working directory when that file exists. So where no such file is there at
import and yaml is not imported yet, numba is imported with yaml masked, and afterwards numba's config gets
a stand-in that imports yaml when numba first uses it (a config file that appears later in the process, at
numba's next config reload). Where PyYAML is not installed, numba sees what it would have seen anyway.

numba.core.entrypoints imports importlib.metadata (with email, zipfile, csv: 0.012-0.015 s) to look up other
packages' numba extensions before numba first compiles, which a process that loads every kernel from numba's
cache never does. So where importlib.metadata is not imported yet, numba is imported with a stand-in in its
place, which imports the real module at the first attribute read from it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

CONFIG_FILE = ".numba_config.yaml"  # numba.core.config._config_fname
LAZY = ("importlib.metadata",)  # modules numba imports but reads only when it compiles


class OnUse:
    """A module imported at the first attribute read from it; its dunder names (`__spec__`, which the import
    system reads of whatever sys.modules holds) import nothing and are not there."""

    def __init__(self, name: str):
        self._module_name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        if sys.modules.get(self._module_name) is self:  # read while it still stands in: the real one from now on
            del sys.modules[self._module_name]
        return getattr(importlib.import_module(self._module_name), attr)


def import_numba() -> None:
    """Import numba, masking yaml where numba would import it without reading anything with it, and standing in
    for the modules in LAZY."""
    if "numba" in sys.modules:
        return
    lazy = {name: OnUse(name) for name in LAZY if name not in sys.modules}
    mask_yaml = "yaml" not in sys.modules and not os.path.isfile(CONFIG_FILE)
    if mask_yaml:
        sys.modules["yaml"] = None  # type: ignore[assignment]  # `import yaml` raises ImportError
    sys.modules.update(lazy)  # type: ignore[arg-type]
    try:
        import numba  # noqa: F401
    finally:
        for name, stand_in in lazy.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
        if mask_yaml and "yaml" in sys.modules and sys.modules["yaml"] is None:
            del sys.modules["yaml"]
    if not mask_yaml:
        return
    from numba.core import config

    if not config._HAVE_YAML and importlib.util.find_spec("yaml") is not None:
        config.yaml = OnUse("yaml")
        config._HAVE_YAML = True
