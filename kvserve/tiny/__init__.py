"""The embedded tiny chat model: its data set (``data``), tokenizer (``tokenizer``),
training loop (``train``) and held-out evaluation (``eval``)."""
