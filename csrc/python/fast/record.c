/* ---- the request record ------------------------------------------------------ */

/* Little-endian stores, as the record is packed ("<"): one move each on
 * x86 (gcc -O2 keeps a byte loop a loop). */
static inline void put_u64le(char *p, uint64_t v)
{
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, sizeof v);
}

static inline void put_u32le(char *p, uint32_t v)
{
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    memcpy(p, &v, sizeof v);
}

/* What _record.REQUEST_ID matches: [A-Za-z0-9._:@/+=-]. */
static inline int request_id_char(unsigned char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_'
        || c == ':' || c == '@' || c == '/' || c == '+' || c == '=' || c == '-';
}

/* The client's request id as the record takes it: its ASCII bytes if it is
 * all REQUEST_ID's characters, and none if not (the record's own id stands
 * in).  A str, or bytes, which ASGI's headers are: their latin-1 text is
 * kept or not alike.  -1: neither, which RequestTimer.start's own path
 * deals with. */
static Py_ssize_t request_id_of(PyObject *rid, const char **data)
{
    const unsigned char *s;
    Py_ssize_t n, k;

    *data = "";
    if (rid == Py_None)
        return 0;
    if (PyBytes_CheckExact(rid)) {
        s = (const unsigned char *)PyBytes_AS_STRING(rid);
        n = PyBytes_GET_SIZE(rid);
    } else if (PyUnicode_CheckExact(rid)) {
        if (!PyUnicode_IS_ASCII(rid))
            return 0;
        s = PyUnicode_1BYTE_DATA(rid);
        n = PyUnicode_GET_LENGTH(rid);
    } else {
        return -1;
    }
    if (n < 1 || n > SHMW_REQ_MAX_REQUEST_ID)
        return 0;
    for (k = 0; k < n; k++)
        if (!request_id_char(s[k]))
            return 0;
    *data = (const char *)s;
    return n;
}
