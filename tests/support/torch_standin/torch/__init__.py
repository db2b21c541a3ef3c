"""Stand-in torch (sparkspec tests): build metadata only, see
tests/support/torch_standin/README.md."""

from torch import utils, version

__version__ = version.__version__

__all__ = ["__version__", "utils", "version"]
