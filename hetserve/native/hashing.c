/* Chained block hashes of a whole prompt in one call (the Conductor hashes every prompt to ask
 * the KV index where its prefix is; a 128k-token prompt is 8192 blocks of 16, which Python's
 * per-block loop hashed in tens of milliseconds).
 *
 * Block i's digest is SHA-256(prefix_i || block_size as u32 LE || its tokens as i64 LE ||
 * extra), where prefix_0 is the seed and prefix_i the digest of block i-1: exactly
 * core/block_hash.py's hash_block_tokens, which the tests compare against. SHA-256 itself is
 * OpenSSL's (libcrypto, already loaded by Python's hashlib), found at run time, so it uses the
 * CPU's SHA extensions where there are some. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef unsigned char *(*sha256_fn)(const unsigned char *, size_t, unsigned char *);

static sha256_fn find_sha256(void) {
    static sha256_fn fn = NULL;
    static int tried = 0;
    if (!tried) {
        const char *names[] = {"libcrypto.so.3", "libcrypto.so", "libcrypto.so.1.1"};
        for (int i = 0; i < 3 && fn == NULL; i++) {
            void *lib = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD);
            if (lib == NULL) lib = dlopen(names[i], RTLD_NOW);
            if (lib != NULL) fn = (sha256_fn)dlsym(lib, "SHA256");
        }
        tried = 1;
    }
    return fn;
}

/* Returns 0, or -1 when no SHA-256 could be found (the caller hashes in Python). `out` gets
 * n_blocks digests of 32 bytes. */
int hetserve_hash_blocks(const uint8_t *seed, int64_t seed_len, const int64_t *tokens,
                         int64_t n_blocks, int64_t block_size, const uint8_t *extra,
                         int64_t extra_len, uint8_t *out) {
    sha256_fn sha = find_sha256();
    if (sha == NULL) return -1;
    int64_t prefix_max = seed_len > 32 ? seed_len : 32;
    size_t cap = (size_t)(prefix_max + 4 + 8 * block_size + extra_len);
    uint8_t *buf = malloc(cap);
    if (buf == NULL) return -1;
    uint32_t bs = (uint32_t)block_size;
    for (int64_t b = 0; b < n_blocks; b++) {
        size_t at = 0;
        if (b == 0) {
            memcpy(buf, seed, (size_t)seed_len);
            at = (size_t)seed_len;
        } else {
            memcpy(buf, out + 32 * (b - 1), 32);
            at = 32;
        }
        memcpy(buf + at, &bs, 4); /* little-endian: x86-64 */
        at += 4;
        memcpy(buf + at, tokens + b * block_size, (size_t)(8 * block_size));
        at += (size_t)(8 * block_size);
        memcpy(buf + at, extra, (size_t)extra_len);
        at += (size_t)extra_len;
        sha(buf, at, out + 32 * b);
    }
    free(buf);
    return 0;
}

/* The KV index's key table (disagg/key_table.py): for each of n keys, the column its
 * linear-probing slot holds, or 0 where the key is absent. Keys 0 and 1 mark an empty and a
 * removed slot; the table's size is a power of two (mask = size - 1) and never full. */
void hetserve_key_lookup(const uint64_t *table_keys, const int64_t *table_cols, uint64_t mask,
                         const uint64_t *keys, int64_t n, int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t k = keys[i], s = k & mask;
        int64_t col = 0;
        for (;;) {
            uint64_t t = table_keys[s];
            if (t == k) {
                col = table_cols[s];
                break;
            }
            if (t == 0) break;
            s = (s + 1) & mask;
        }
        out[i] = col;
    }
}

/* The same lookup from the digests themselves: each 32-byte digest (four little-endian words)
 * folded into its key as key_table.keys_of does (odd multipliers, keys 0 and 1 moved up by 2),
 * probed, and a hit kept only where the column's stored digest (stored[col], four words) is the
 * same: exact, with no key array or gathered copy for the caller to build. */
void hetserve_digest_lookup(const uint64_t *table_keys, const int64_t *table_cols, uint64_t mask,
                            const uint64_t *stored, const uint64_t *digests, int64_t n,
                            int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint64_t *d = digests + 4 * i;
        uint64_t k = d[0] * 0x9E3779B97F4A7C15ULL ^ d[1] * 0xBF58476D1CE4E5B9ULL ^
                     d[2] * 0x94D049BB133111EBULL ^ d[3];
        if (k <= 1) k += 2;
        uint64_t s = k & mask;
        int64_t col = 0;
        for (;;) {
            uint64_t t = table_keys[s];
            if (t == k) {
                col = table_cols[s];
                break;
            }
            if (t == 0) break;
            s = (s + 1) & mask;
        }
        if (col) {
            const uint64_t *h = stored + 4 * col;
            if (h[0] != d[0] || h[1] != d[1] || h[2] != d[2] || h[3] != d[3]) col = 0;
        }
        out[i] = col;
    }
}
