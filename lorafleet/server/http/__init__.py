"""The HTTP routes, one module per group of the Tinker API; `lorafleet.server.app` assembles them.

Each group's `add_routes(app, ...)` registers its routes on the app with only the part of
`Service` that answers them, so a route module shows which part that is and reaches no other.
(They register on the app rather than build `APIRouter`s: `include_router` would hide the
routes behind a wrapper in `app.routes`, which the security battery enumerates.)"""

API = "/api/v1"
