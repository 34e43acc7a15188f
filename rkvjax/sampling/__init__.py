"""Sampling: the request's settings with vLLM's field names (`params.SamplingParams`) and the
device search that draws each row's next token from them (`sampler`)."""
