"""Text: the tokenizer and chat template (`tokenizer`), and incremental detokenization of streamed
tokens (`detokenize`). Knows nothing of models or caches."""
