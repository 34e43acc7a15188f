"""The KV cache and its policies: the cache's config (`config.CompressionConfig`), the cache
itself (`cache`) and its 8-bit storage (`quantization`), the keep rule (`selection`), a
compression applied to the cache per layer and row (`compress`), the scores and their kernels
(`scores`, `kernels/`), and the methods (`policies/`, each with its own statistics). Knows
nothing of requests or the runtime."""
