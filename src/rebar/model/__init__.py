"""Weights to math: configs, loaders, the Llama-family and BERT models, tokenizers and chat
templates; knows nothing about requests."""
