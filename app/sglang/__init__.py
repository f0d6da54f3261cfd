"""The SGLang side: every HTTP client of an SGLang server and SGLang's own request rules.

`client` is the native `POST /generate` client and its probes, `errors` the one mapping of
HTTP/transport failures to `app.core.errors` (`map_http_error`), `responses` the checks of a
/generate answer, `schema` and `rules` SGLang's request gate (the emulator imports them too).
"""
