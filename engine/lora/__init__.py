"""Multi-LoRA: PEFT adapters on one base model, chosen per request.

    config.py    LoRAConfig (--enable-lora, --lora-modules, --max-loras, --max-lora-rank, --max-cpu-loras)
    adapter.py   reading and checking a PEFT adapter directory (LoRAError)
    layers.py    the device slots beside each linear layer, and the step's token -> slot map
    manager.py   the registry, the host cache and the slots (LoRAManager, LoRAInfo)
"""
