"""Config loading (strict YAML + CLI dotlist -> dataclasses) and the top-level run config."""

from megatron_mecefo.config.loader import from_dict, load_config, parse_dotlist, read_yaml, to_dict

__all__ = ["from_dict", "load_config", "parse_dotlist", "read_yaml", "to_dict"]
