"""The model runner's start-up, one module per job; `build_engine` (moe_serve/engine/core.py) calls
their steps in order and hands the parts to `ModelRunner` (moe_serve/model_runner.py), which runs
the steps of serving.

`loading.py`  build the model, load or draw its weights, prepare them, warm up the Triton kernels
`memory.py`   profile a step's (and the decode graphs') memory, size the KV cache, allocate it
`graphs.py`   whether decode steps are padded and captured, and the capture of the graph ladder
"""
