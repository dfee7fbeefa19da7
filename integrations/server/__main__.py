"""`python -m paged_backend.integrations.server [flags]`: the same as `paged-backend serve`."""

import argparse

from .cli import add_serve_arguments, run_serve

parser = argparse.ArgumentParser(prog="python -m paged_backend.integrations.server",
                                 description="OpenAI-compatible server on the paged engine")
add_serve_arguments(parser)
run_serve(parser.parse_args())
