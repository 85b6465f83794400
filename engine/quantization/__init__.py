"""Quantized weights: which layers get which method, and the methods themselves.

    config.py    --quantization + the checkpoint's quantization_config -> QuantizationConfig
                 (torch-free: resolved and validated at start, before any weight is read)
    methods.py   QuantMethods: a layer's method by its checkpoint name (ignore lists, targets)
    fp8.py       FP8 W8A8: Fp8LinearMethod (tensor, channel, block scales; online fp8) and
                 Fp8MoEMethod (the experts of a mixture-of-experts block)
    int4.py      int4 W4A16: Int4LinearMethod (AutoAWQ, GPTQ, compressed-tensors pack-quantized)
    mxfp4.py     MXFP4 experts (gpt-oss): Mxfp4MoEMethod, weight-only, packed in memory
    gguf.py      GGUF blocks (Q4_0, Q4_1, Q8_0) as the file ships them: GgufLinearMethod, CPU kernel

A method plugs into engine/layers/ (``LinearMethod``, ``MoEMethod``): it creates the
checkpoint's tensors with the layer's ``add_param``, converts them to its kernel's layout
in ``process_weights_after_loading`` and runs the kernel in ``apply``. Nothing here is
imported by the layers (they receive methods), so layers never import upward.
"""
