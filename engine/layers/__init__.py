"""The building blocks model families wire together (engine/models/).

    linear.py      ReplicatedLinear, ColumnParallelLinear (stacked parts), RowParallelLinear;
                   the LinearMethod hook (quantized methods plug in there); loader attributes
    attention.py   AttentionMetadata; the self-attention block over the paged KV cache
    rotary.py      RoPE tables (default, linear, llama3, yarn, dynamic, longrope), partial rotary
    norm.py        RMSNorm, plain (Llama) or offset (Gemma's 1 + w)
    activation.py  gated activations (SiLU, GELU-tanh)
    embedding.py   vocabulary-parallel embedding and LM head (tied, soft-capped)
    moe.py         FusedMoE: router, experts, the fused kernel, per-expert load

Layers call kernels through ``ops`` (``kernels`` on CUDA, ``kernels.reference`` on
CPU) and import nothing above them (engine/models, the runner, services).
"""
