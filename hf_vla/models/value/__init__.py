from .configuration_value import PI05ValueConfig
from .modeling_value import PI05ValueModel, PI05ValueOutput

__all__ = ["PI05ValueConfig", "PI05ValueModel", "PI05ValueOutput"]
