"""Kernels: device operations with tensors in and tensors out, each Triton kernel beside the PyTorch
code that is its CPU path and the tests' reference. Row moves between the host pool and the device
(``transfer``) and their 8-bit codec (``int8_rows``); a decode step's split-KV attention
(``decode_attention``); the scores of cached keys and the quantized partial keys (``scoring``); the
sort-free top-k in slot order (``top_slots``); resident-row placement (``placement``); growable
per-slot buffers (``buffers``). This room imports no other room of the runtime: what it reads of a
pool is a protocol (``transfer.BlockedRows``), not the pool."""
