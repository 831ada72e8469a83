"""Weight quantization: ``--quantization {fp8,int8,awq,gptq}`` and checkpoints' ``quantization_config``
(config.py), the published 4-bit layouts (formats.py), and the quantized linear layers (linear.py)."""
