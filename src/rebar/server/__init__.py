"""The HTTP service: the shell (app, middleware, auth, error shapes, SSE), one request pipeline,
and the API dialects in front of it."""
