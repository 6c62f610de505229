"""The engine integrations: vLLM's plugin (both modes) and nano-vllm's input preparation."""
