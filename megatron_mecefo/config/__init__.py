"""Config loading (strict YAML + CLI dotlist -> dataclasses) and the top-level run config.

`RunConfig` composes every subsystem's config, so `config/` sits above the subsystems it imports
configs from (`data`, `mcore`, `mecefo`, `metrics`, `plan`: their `config.py` beside their code)
and below those that import it (`training`, `checkpoint`, `snapshot`, `failover`: their config
dataclasses live here, in `config/<subsystem>.py`). `tests/unit/test_layers.py` holds the order.
"""

from megatron_mecefo.config.loader import from_dict, load_config, parse_dotlist, read_yaml, to_dict

__all__ = ["from_dict", "load_config", "parse_dotlist", "read_yaml", "to_dict"]
