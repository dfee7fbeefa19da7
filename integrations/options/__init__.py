"""How each front end's option vocabulary becomes engine options.

`vocabularies` holds one translation table per vocabulary (OpenAI request fields, vLLM's own
SamplingParams names, LangChain options, transformers' GenerationConfig, the command line) into
`SamplingParams`; `defaults` the one table of what each front end samples with when the caller says
nothing; `schema` the pydantic fields the server's and LangChain's models generate from their table's
rows; `flags` the command-line flags generated from `EngineConfig` and `SamplingParams` fields.
"""
