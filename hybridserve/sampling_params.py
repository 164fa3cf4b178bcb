"""`hybridserve.sampling_params.SamplingParams`, where vLLM users import it from: the same type the
engine samples with and `GenerateMsg` carries (`workers.engine.sampling_params`), not a copy."""

from workers.engine.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
