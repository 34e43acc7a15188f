"""What a user types or sends: the command line (`cli`), the OpenAI-compatible server
(`serve/`), offline jobs (`jobs/`), evaluation (`evaluation/`) and TriAttention's calibration
run (`calibration`). Built on the public API and the runtime; nothing below imports it."""
