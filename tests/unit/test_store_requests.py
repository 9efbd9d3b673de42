"""The store's plain reading of a request head (elastic_ext.launch.store_requests.PlainHead): every head reads
exactly as http.server reads it, the plain ones without the email parser, the others through http.server itself."""

import io
from http.server import BaseHTTPRequestHandler

import pytest

from elastic_ext.launch.store_requests import InMemory, PlainHead, plain_head

BODY = b"0123456789"
HEADS = [
    b"GET /scope/key HTTP/1.0\r\n\r\n",
    b"GET /scope/key HTTP/1.1\r\nHost: 10.0.0.1:4000\r\nAccept-Encoding: identity\r\nConnection: close\r\n\r\n",
    b"PUT /scope/key HTTP/1.1\r\nContent-Length: 10\r\nX-Secret:  padded value \r\n\r\n" + BODY,
    b"PUT /scope/key HTTP/1.0\r\ncontent-length: 10\r\nContent-Length: 3\r\n\r\n" + BODY,  # two: the first counts
    b"GET /scope/key HTTP/1.1\r\nConnection: keep-alive\r\nExpect: 100-continue\r\nEmpty:\r\n\r\n",
    b"DELETE /a/b/c?x=1 HTTP/1.0\r\nX-Tab:\tvalue\r\n\r\n",
    b"GET /scope/key HTTP/1.0\r\nLatin: caf\xe9\r\n\r\n",
    # Not plain: http.server reads these (and answers the bad ones).
    b"GET //scope/key HTTP/1.0\r\n\r\n",
    b"GET /scope/key HTTP/1.0\r\nFolded: one\r\n two\r\n\r\n",
    b"GET /scope/key HTTP/1.0\r\nNo colon here\r\n\r\n",
    b"GET /scope/key HTTP/1.0\nBare: newline\n\n",
    b"GET /scope/key HTTP/1.0\r\nBad Name: x\r\n\r\n",
    b"GET /scope/key HTTP/2.0\r\n\r\n",
    b"GET /scope/key HTTP/1.x\r\n\r\n",
    b"GET /scope/key\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET /scope/key HTTP/1.0\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(101)) + b"\r\n",
    b"GET /scope/key HTTP/1.0\r\nLong: " + b"x" * 70000 + b"\r\n\r\n",
]


class Stdlib(BaseHTTPRequestHandler):
    def __init__(self, request):  # what socketserver's handler does, without a server
        self.request, self.client_address = request, ("10.0.0.2", 5000)
        self.rfile, self.wfile = request.makefile("rb"), io.BytesIO()

    def log_message(self, *args):
        pass

    def read(self):
        self.raw_requestline = self.rfile.readline(65537)
        ok = self.parse_request()
        outcome = {"ok": ok, "answer": self.wfile.getvalue().split(b"\r\n")[0]}
        if ok:
            outcome.update(command=self.command, path=self.path, version=self.request_version,
                           requestline=self.requestline, close=self.close_connection,
                           headers=list(self.headers.items()), header_type=type(self.headers),
                           body=self.rfile.read())
        return outcome


class Plain(PlainHead, Stdlib):
    pass


@pytest.mark.parametrize("head", HEADS, ids=range(len(HEADS)))
def test_each_head_reads_as_http_server_reads_it(head):
    def read(cls):
        return cls(InMemory(head, lambda answer: None)).read()

    assert read(Plain) == read(Stdlib)


def test_only_plain_heads_skip_http_servers_parse():
    plain = [head for head in HEADS if plain_head(head) is not None]
    assert plain == HEADS[:7], [HEADS.index(head) for head in plain]
    words, fields, body = plain_head(HEADS[2])
    assert (words, fields, HEADS[2][body:]) == (["PUT", "/scope/key", "HTTP/1.1"],
                                                [("Content-Length", "10"), ("X-Secret", "padded value ")], BODY)


def test_the_date_header_is_http_servers_to_the_second():
    handler = Plain(InMemory(HEADS[0], lambda answer: None))
    for _ in range(3):
        before, ours, after = Stdlib.date_time_string(handler), handler.date_time_string(), \
            Stdlib.date_time_string(handler)
        assert ours in {before, after}  # the same second, or the next one if a second began between
    assert handler.date_time_string(0) == "Thu, 01 Jan 1970 00:00:00 GMT"
