"""GGUF language models to MNN-LLM bundles, with an independent numpy reference."""
