"""Kernels of LoRA adapters (`lora`) and quantized matmuls (`quant_matmul`), each with its plain-torch twin
(`lora_reference`, `quant_reference`)."""
