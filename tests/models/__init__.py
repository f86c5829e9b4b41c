"""In-process tests on the embedded models (SmolLM2 GGUF, all-MiniLM-L6-v2) without a server: HF / sentence-
transformers oracles, real tokenizers, quantization accuracy, engine behaviour on the real weights."""
