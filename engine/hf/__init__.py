"""A Hugging Face model directory read: config.json and its families, tokenizer and chat template,
generation_config, sentence-transformers' files, safetensors loading."""
