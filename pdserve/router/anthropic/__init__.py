"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) over the chat path:
request.py turns a Messages body into a chat request, events.py turns the chat deltas into a
message and its stream of events, errors.py gives errors Anthropic's shape."""
