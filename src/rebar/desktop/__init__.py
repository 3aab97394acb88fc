"""`rebar desktop`: the chat page in a native window over the system's web view (pywebview on
WebKitGTK), on a private `rebar serve` process that only that window holds the key to."""
