"""One module per API dialect: each parses its request bodies into the pipeline's neutral request
and renders the neutral results back, whole and streamed. Dialects never import one another; what
the OpenAI dialects share (body schemas, response fields) lives in the `openai_*` helper modules."""
