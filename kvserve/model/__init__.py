"""The model runtime: Llama-family decoders in plain PyTorch over a paged KV cache.

``llama.py`` (the model), ``rope.py`` (rotary embeddings), ``attention.py`` (paged attention and its
metadata), ``loader.py`` (checkpoint folder -> model, tokenizer), ``registry.py`` (architecture
name -> class), ``presets.py`` + ``make_model.py`` + ``tokenizer_builder.py`` (random-weight
checkpoints for tests and benchmarks). Import the submodules directly.
"""
