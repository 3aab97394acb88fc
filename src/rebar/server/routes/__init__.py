"""Routes that are not an API dialect: health, readiness and metrics, tokenize, the model listing,
the admin calls and the chat page."""
