"""Operations: monitoring config, benchmarks (``ops.bench``) and the chaos soak (``ops.chaos``)."""
