# The test suite hides the installed mamba_ssm from this process (tests/realkernels): transformers falls back to its
# torch kernels, which run on CPU without Triton's interpreter. The real kernels run in their own worker pool.
raise ImportError("mamba_ssm is hidden in this test process (tests/realkernels/hidden is first on sys.path)")
