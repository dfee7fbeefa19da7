"""OpenAI's harmony format (gpt-oss), one package for what the reasoning and tool-call packages each have one file
for: the messages of an answer (messages.py), its reasoning parser (reasoning.py) and its tool-call parser
(tool_calls.py)."""
