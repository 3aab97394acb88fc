"""One request pipeline for every dialect: a protocol-neutral request (`request`) goes down
through the stages — lease the model's version (`lease`), build its prompt (`prepare`), pass the
gate (`gate`), the response cache (`cache`), generate (`generate`) — and its answer comes back up
through each, read for the client (`answer`) as neutral results (`results`) for the dialect to
render."""
