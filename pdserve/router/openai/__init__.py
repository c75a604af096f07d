"""The OpenAI API as the router speaks it: request schemas and their checks, errors, chat
templates and tool calls, structured-output requests, the Responses API's items and events,
and the streamed replies. No routes here (router.routes) and no nodes (router.dispatch)."""
