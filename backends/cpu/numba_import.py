"""numba imported without importing PyYAML, which it needs only to read a `.numba_config.yaml`.

numba.core.config imports yaml at its import (0.015 s of a second process's ~0.6 s to its first token on the
2-core machine: yaml's reader, scanner and constructors) and uses it in one place: reading
`.numba_config.yaml` from the working directory when that file exists. So where no such file is there at
import and yaml is not imported yet, numba is imported with yaml masked, and afterwards numba's config gets
a stand-in that imports yaml when numba first uses it (a config file that appears later in the process, at
numba's next config reload). Where PyYAML is not installed, numba sees what it would have seen anyway.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

CONFIG_FILE = ".numba_config.yaml"  # numba.core.config._config_fname


class YamlOnUse:
    """The yaml module, imported at the first attribute numba reads from it."""

    def __getattr__(self, name: str) -> Any:
        import yaml

        return getattr(yaml, name)


def import_numba() -> None:
    """Import numba, masking yaml where numba would import it without reading anything with it."""
    if "numba" in sys.modules or "yaml" in sys.modules or os.path.isfile(CONFIG_FILE):
        import numba  # noqa: F401
        return
    sys.modules["yaml"] = None  # type: ignore[assignment]  # `import yaml` raises ImportError
    try:
        import numba  # noqa: F401
    finally:
        if "yaml" in sys.modules and sys.modules["yaml"] is None:
            del sys.modules["yaml"]
    from numba.core import config

    if not config._HAVE_YAML and importlib.util.find_spec("yaml") is not None:
        config.yaml = YamlOnUse()
        config._HAVE_YAML = True
