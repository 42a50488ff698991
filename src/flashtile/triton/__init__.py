"""flashtile's Triton kernels and their launchers.

* ``scores``: the score pipeline and the one visibility rule (``@triton.jit`` helpers);
* ``attention``: the forward, the backward's preprocess, dK/dV and dQ kernels;
* ``decode``: attention against a (paged) KV cache, split-KV;
* ``merge``: merging partial results through their log-sum-exps;
* ``configs``: block shapes and code-path thresholds from H200 sweeps;
* ``launch``: tensors and options → kernel, grid and keyword arguments (the only module that
  launches).
"""
