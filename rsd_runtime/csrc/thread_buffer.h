/* A kernel's scratch (packed or quantised input rows): one buffer per calling thread, grown as needed and
   kept, so a call allocates nothing. Read it into a local before an OpenMP region: inside one, the
   thread-local variable would name each worker's own (empty) buffer. */
#include <stdlib.h>
static void* thread_buffer(int64_t bytes) { /* NULL if it cannot be had */
    static __thread void* buffer;
    static __thread int64_t capacity;
    if (bytes > capacity) {
        free(buffer);
        buffer = malloc(bytes);
        capacity = buffer ? bytes : 0;
    }
    return buffer;
}
