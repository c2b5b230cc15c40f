"""The tiny local reasoning model: tokenizer, model, SFT recipe, offline evaluation, model card."""
