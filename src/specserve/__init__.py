"""specserve: speculative decoding that pays off.

    from specserve import LLM, SamplingParams, SpeculativeConfig
"""

from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM
from specserve.types import GenerationResult, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "GenerationResult", "SamplingParams", "SpeculativeConfig", "__version__"]
