"""Speed and memory harness (docs/benchmarks.md). Entry points, each ``python -m benchmarks.<name>``:

    train_step      compile time, step time (median, spread), images/s, FLOPs, MFU, memory;
                    ``--norm=all``: every normalizer in one process, as ratios to LayerNorm
    inference       eval-mode throughput per normalizer
    input_pipeline  examples/s of the train pipeline per dataset vs what the train step consumes
    vs_torch        the same ViT trained in timm/PyTorch and here, alternating, as a ratio
    matmul          the model's matmul shapes in XLA and in torch (is a gap the kernel library?)
    memory          largest per-device batch that fits, per model size, with and without remat
    compile_time    compile time against depth, unrolled and with ``model.scan``
    gpu_table       the GPU table of docs/benchmarks.md: isolated per-norm train_step + vs_torch

Every entry point sets XLA flags (``benchmarks.xla_flags``) before JAX is imported. Nothing in
this package is imported by the library.
"""
