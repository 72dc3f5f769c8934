"""vLLM's module path `vllm.pooling_params`, kept for code written against it; the type lives in
`engine.params.pooling_params`."""

from engine.params.pooling_params import PoolingParams

__all__ = ["PoolingParams"]
