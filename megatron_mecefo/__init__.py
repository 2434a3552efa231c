"""megatron-mecefo: fault-tolerant LLM pretraining on Megatron-Core.

Importing the package is cheap: it imports neither torch nor megatron.core; subpackages do so
lazily.
"""

__version__ = "0.1.0"
