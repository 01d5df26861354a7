"""Test-only stand-in for the one vLLM function SGLang 0.5.23 imports on device cpu.

SGLang's CPU path calls ``vllm._custom_ops.rotary_embedding``; installing vLLM for it
would pull another CUDA stack, so the tests put this package on ``sys.path`` instead.
It is never installed and never imported outside ``tests/sglang``.
"""
