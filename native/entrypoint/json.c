/*
 * Bounded JSON text, for entrypoint.json (control.c). Every string goes through jb_str, which
 * writes an RFC 8259 string literal whatever the bytes: '"' and '\' escaped, every byte below
 * 0x20 escaped, valid UTF-8 copied, and each maximal ill-formed subsequence (a stray continuation
 * byte, an overlong form, a surrogate, a code point past U+10FFFF, a sequence cut short) replaced
 * by U+FFFD, the way Python's bytes.decode("utf-8", "replace") does it. A string is cut at a
 * limit of input bytes on a character boundary, never inside a character or an escape. The
 * buffer never overflows: text that would not fit marks it full, and a full buffer is never
 * written out (control.c proves by a static assertion that the control file always fits).
 * Calls nothing of the entrypoint's other files.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "entrypoint.h"

void jb_init(struct jbuf *b, char *p, size_t cap)
{
	b->p = p;
	b->cap = cap;
	b->len = 0;
	b->full = cap == 0;
	if (cap)
		p[0] = '\0';
}

static void jb_mem(struct jbuf *b, const char *s, size_t n)
{
	if (b->full || n >= b->cap - b->len) {
		b->full = true;
		return;
	}
	memcpy(b->p + b->len, s, n);
	b->len += n;
	b->p[b->len] = '\0';
}

void jb_raw(struct jbuf *b, const char *s)
{
	jb_mem(b, s, strlen(s));
}

void jb_fmt(struct jbuf *b, const char *fmt, ...)
{
	char tmp[128];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
	va_end(ap);
	if (n < 0 || (size_t)n >= sizeof(tmp)) {
		b->full = true; /* only numbers go through here: never happens, never half-written */
		return;
	}
	jb_mem(b, tmp, (size_t)n);
}

/*
 * Length of the UTF-8 character at s (s[0] != 0), or of the maximal ill-formed subsequence there
 * (*ok false): the bytes up to the first one that cannot continue a well-formed sequence (Unicode
 * 15, section 3.9, table 3-7). Reads no byte past the string's NUL, which never continues one.
 */
size_t utf8_seq(const unsigned char *s, bool *ok)
{
	unsigned char c = s[0], lo = 0x80, hi = 0xbf;
	size_t need, i;

	*ok = true;
	if (c < 0x80)
		return 1;
	if (c >= 0xc2 && c <= 0xdf) {
		need = 1;
	} else if (c >= 0xe0 && c <= 0xef) {
		need = 2;
		lo = c == 0xe0 ? 0xa0 : 0x80; /* no overlong forms */
		hi = c == 0xed ? 0x9f : 0xbf; /* no surrogates */
	} else if (c >= 0xf0 && c <= 0xf4) {
		need = 3;
		lo = c == 0xf0 ? 0x90 : 0x80;
		hi = c == 0xf4 ? 0x8f : 0xbf; /* nothing past U+10FFFF */
	} else {
		*ok = false; /* 0x80-0xc1, 0xf5-0xff never start a character */
		return 1;
	}
	for (i = 1; i <= need; i++) {
		if (s[i] < lo || s[i] > hi) {
			*ok = false;
			return i;
		}
		lo = 0x80;
		hi = 0xbf;
	}
	return i;
}

/* One character (or ill-formed subsequence) of n bytes at s, as JSON string text. */
static void jb_char(struct jbuf *b, const unsigned char *s, size_t n, bool ok)
{
	static const char short_esc[] = { ['\b'] = 'b', ['\f'] = 'f', ['\n'] = 'n', ['\r'] = 'r', ['\t'] = 't' };
	char esc[8];

	if (!ok) {
		jb_raw(b, "\xef\xbf\xbd"); /* U+FFFD REPLACEMENT CHARACTER */
	} else if (s[0] == '"' || s[0] == '\\') {
		esc[0] = '\\';
		esc[1] = (char)s[0];
		jb_mem(b, esc, 2);
	} else if (s[0] < 0x20) {
		if (s[0] < sizeof(short_esc) && short_esc[s[0]])
			snprintf(esc, sizeof(esc), "\\%c", short_esc[s[0]]);
		else
			snprintf(esc, sizeof(esc), "\\u%04x", s[0]);
		jb_raw(b, esc);
	} else {
		jb_mem(b, (const char *)s, n);
	}
}

void jb_str(struct jbuf *b, const char *str, size_t limit)
{
	const unsigned char *s = (const unsigned char *)str;
	size_t used = 0;

	if (!str) {
		jb_raw(b, "null");
		return;
	}
	jb_mem(b, "\"", 1);
	while (*s) {
		bool ok;
		size_t n = utf8_seq(s, &ok);
		if (used + n > limit)
			break; /* the next character would pass the limit: cut before it */
		used += n;
		jb_char(b, s, n, ok);
		s += n;
	}
	jb_mem(b, "\"", 1);
}
