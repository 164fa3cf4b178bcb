"""Offline Python API in the shape of vLLM's:

    from hybridserve import LLM, SamplingParams

    llm = LLM("configs/models/tiny-trained")
    outs = llm.generate(["def main():"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text, outs[0].num_cached_tokens)
"""

from hybridserve.llm import LLM
from hybridserve.outputs import CompletionOutput, RequestOutput
from hybridserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
