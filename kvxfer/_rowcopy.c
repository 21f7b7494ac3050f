/* kvxfer._rowcopy: the host row copies between an engine's KV layers and an arena slot (kvxfer.copies.HostRows).
 *
 * One call copies rows[0..nrows) of each of nlayers layers (each layer: span_rows rows,
 * row_pitch bytes apart, row_bytes long, which may overlap in the view, starting at
 * layer_ptrs[l]) to or from one slot, whose
 * row r of layer l is at slot + l * slot_layer_stride + r * slot_row_stride. Every row id is
 * checked against span_rows before a byte moves. The copy runs without the GIL, on the calling
 * thread and up to threads - 1 more, with non-temporal stores where the CPU has them: a chunk is
 * larger than the caches, and streaming stores do not read each destination line first (what a
 * cached store does), which makes a row gather as fast as a memcpy of the same bytes or faster.
 *
 * The pointers are the caller's (its own tensors' addresses, not input from outside); the caller
 * keeps the memory alive for the call. The row ids are copied while they are checked, so ids
 * changed by another thread during the copy are never used; a scatter that names a row twice
 * runs on one thread, so the row ends as its last write left it. POSIX (pthreads) and GCC or clang;
 * setup.py builds it on the limited C API (one wheel for every CPython >= 3.10) except on a
 * free-threaded CPython, which has none. */
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVX_X86 1
#endif

/* Below this many bytes per thread, another thread costs more than it copies. */
#define MIN_BYTES_PER_THREAD ((int64_t)4 << 20)
#define MAX_THREADS 1024

typedef void (*copy_fn)(char *dst, const char *src, size_t n);

static void copy_plain(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }

#ifdef KVX_X86
/* dst aligned to the vector first (memcpy of the head), then 4 streaming stores per step. */
static void copy_stream_sse2(char *dst, const char *src, size_t n) {
  size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
  if (head > n) head = n;
  memcpy(dst, src, head);
  dst += head, src += head, n -= head;
  size_t body = n & ~(size_t)63;
  for (size_t k = 0; k < body; k += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(src + k));
    __m128i b = _mm_loadu_si128((const __m128i *)(src + k + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + k + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + k + 48));
    _mm_stream_si128((__m128i *)(dst + k), a);
    _mm_stream_si128((__m128i *)(dst + k + 16), b);
    _mm_stream_si128((__m128i *)(dst + k + 32), c);
    _mm_stream_si128((__m128i *)(dst + k + 48), d);
  }
  memcpy(dst + body, src + body, n - body);
}

__attribute__((target("avx"))) static void copy_stream_avx(char *dst, const char *src, size_t n) {
  size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
  if (head > n) head = n;
  memcpy(dst, src, head);
  dst += head, src += head, n -= head;
  size_t body = n & ~(size_t)127;
  for (size_t k = 0; k < body; k += 128) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(src + k));
    __m256i b = _mm256_loadu_si256((const __m256i *)(src + k + 32));
    __m256i c = _mm256_loadu_si256((const __m256i *)(src + k + 64));
    __m256i d = _mm256_loadu_si256((const __m256i *)(src + k + 96));
    _mm256_stream_si256((__m256i *)(dst + k), a);
    _mm256_stream_si256((__m256i *)(dst + k + 32), b);
    _mm256_stream_si256((__m256i *)(dst + k + 64), c);
    _mm256_stream_si256((__m256i *)(dst + k + 96), d);
  }
  _mm256_zeroupper();
  memcpy(dst + body, src + body, n - body);
}
#endif

typedef struct {
  const char *name;
  copy_fn fn;
} kernel_t;

/* Every copy this build has, best first; the first one the CPU runs is used. */
static const kernel_t kernels[] = {
#ifdef KVX_X86
    {"avx-stream", copy_stream_avx},
    {"sse2-stream", copy_stream_sse2},
#endif
    {"memcpy", copy_plain},
};
#define NKERNELS ((int)(sizeof(kernels) / sizeof(kernels[0])))

static int kernel_runs(int k) {
#ifdef KVX_X86
  if (kernels[k].fn == copy_stream_avx) return __builtin_cpu_supports("avx");
#endif
  (void)k;
  return 1;
}

static copy_fn stream_copy = copy_plain;
static const char *stream_name = "memcpy";
/* Tests only (_fail_threads): no thread is started, as when pthread_create fails. */
static int fail_threads = 0;

static void pick_copy(void) {
#ifdef KVX_X86
  __builtin_cpu_init();
#endif
  for (int k = 0; k < NKERNELS; k++) {
    if (kernel_runs(k)) {
      stream_copy = kernels[k].fn, stream_name = kernels[k].name;
      return;
    }
  }
}

typedef struct {
  int to_slot;
  char *slot;
  const uint64_t *layer_ptrs;
  int64_t row_pitch, row_bytes, slot_layer_stride, slot_row_stride;
  const int64_t *rows;
  int64_t nrows;
  int64_t first, stop; /* items [first, stop): item i is row i % nrows of layer i / nrows */
} job_t;

static void run_job(const job_t *j) {
  for (int64_t i = j->first; i < j->stop; i++) {
    int64_t l = i / j->nrows, r = i % j->nrows;
    char *engine = (char *)(uintptr_t)j->layer_ptrs[l] + j->rows[r] * j->row_pitch;
    char *slot = j->slot + l * j->slot_layer_stride + r * j->slot_row_stride;
    if (j->to_slot) {
      stream_copy(slot, engine, (size_t)j->row_bytes);
    } else {
      stream_copy(engine, slot, (size_t)j->row_bytes);
    }
  }
#ifdef KVX_X86
  _mm_sfence(); /* streaming stores are weakly ordered: visible before the call returns */
#endif
}

static void *run_job_thread(void *arg) {
  run_job((const job_t *)arg);
  return NULL;
}

/* Copies the items in `threads` parts, one on the calling thread; a part whose thread cannot be
 * started (or all, without memory for their bookkeeping) is copied on the calling thread.
 * Returns the threads that copied (the calling one included). */
static int run_parallel(job_t *base, int threads) {
  int64_t items = base->stop;
  job_t *jobs = malloc(sizeof(job_t) * threads);
  pthread_t *tids = malloc(sizeof(pthread_t) * threads);
  int *started = malloc(sizeof(int) * threads);
  if (jobs == NULL || tids == NULL || started == NULL) {
    free(jobs), free(tids), free(started);
    run_job(base);
    return 1;
  }
  for (int t = 0; t < threads; t++) {
    jobs[t] = *base;
    jobs[t].first = items / threads * t + (items % threads) * t / threads;
    started[t] = 0;
  }
  for (int t = 0; t < threads; t++) {
    jobs[t].stop = t + 1 < threads ? jobs[t + 1].first : items;
  }
  int ran = 1;
  for (int t = 1; t < threads; t++) {
    started[t] = !fail_threads && pthread_create(&tids[t], NULL, run_job_thread, &jobs[t]) == 0;
    ran += started[t];
  }
  run_job(&jobs[0]);
  for (int t = 1; t < threads; t++) {
    if (started[t]) {
      pthread_join(tids[t], NULL);
    } else {
      run_job(&jobs[t]); /* no thread to spare: copy its part here */
    }
  }
  free(jobs), free(tids), free(started);
  return ran;
}

static int by_id(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Whether a row id repeats among ids[0..n), all in [0, span): a bitmap of span bits where it
 * takes at most two words per id, else a sorted copy; -1 without memory for either. Runs
 * without the GIL (it reads only the private, checked copy of the ids). */
static int repeats(const int64_t *ids, int64_t n, int64_t span) {
  if (n < 2) return 0;
  if (span / 64 <= n * 2) {
    uint64_t *seen = calloc((size_t)(span / 64 + 1), sizeof(uint64_t));
    if (seen == NULL) return -1;
    int found = 0;
    for (int64_t r = 0; r < n && !found; r++) {
      uint64_t bit = (uint64_t)1 << (ids[r] % 64);
      found = (seen[ids[r] / 64] & bit) != 0;
      seen[ids[r] / 64] |= bit;
    }
    free(seen);
    return found;
  }
  int64_t *sorted = malloc(sizeof(int64_t) * (size_t)n);
  if (sorted == NULL) return -1;
  memcpy(sorted, ids, sizeof(int64_t) * (size_t)n);
  qsort(sorted, (size_t)n, sizeof(int64_t), by_id);
  int found = 0;
  for (int64_t r = 1; r < n && !found; r++) found = sorted[r] == sorted[r - 1];
  free(sorted);
  return found;
}

static PyObject *copy_rows(PyObject *self, PyObject *args) {
  (void)self;
  int to_slot, threads;
  unsigned long long slot, layer_ptrs, rows;
  long long nlayers, span_rows, row_pitch, row_bytes, slot_layer_stride, slot_row_stride, nrows;
  if (!PyArg_ParseTuple(args, "pKKLLLLLLKLi", &to_slot, &slot, &layer_ptrs, &nlayers, &span_rows, &row_pitch,
                        &row_bytes, &slot_layer_stride, &slot_row_stride, &rows, &nrows, &threads)) {
    return NULL;
  }
  /* Engine rows may overlap in the layer's row view (row_pitch < row_bytes: padded or interleaved
   * layouts, docs in kvxfer/layout.py); the slot's rows may not. */
  if (nlayers < 0 || nrows < 0 || row_bytes < 0 || span_rows < 0 || row_pitch < 0 ||
      slot_row_stride < row_bytes || slot_layer_stride < 0 || threads < 1) {
    PyErr_SetString(PyExc_ValueError,
                    "copy_rows: negative sizes or strides, slot rows closer than their length, or no thread");
    return NULL;
  }
  long long items, bytes, last;
  if (__builtin_mul_overflow(nlayers, nrows, &items) || __builtin_mul_overflow(items, row_bytes, &bytes) ||
      __builtin_mul_overflow(span_rows, row_pitch, &last) ||
      __builtin_mul_overflow(nlayers, slot_layer_stride, &last) ||
      __builtin_mul_overflow(nrows, slot_row_stride, &last)) {
    PyErr_SetString(PyExc_OverflowError, "copy_rows: sizes overflow 64 bits");
    return NULL;
  }
  if (items == 0 || row_bytes == 0) {
    return PyLong_FromLong(0);
  }
  /* The ids are checked as they are copied, and only the copy is used. */
  if ((unsigned long long)nrows > (unsigned long long)PY_SSIZE_T_MAX / sizeof(int64_t)) {
    PyErr_SetString(PyExc_OverflowError, "copy_rows: too many rows");
    return NULL;
  }
  int64_t *ids = malloc(sizeof(int64_t) * (size_t)nrows);
  if (ids == NULL) {
    return PyErr_NoMemory();
  }
  const volatile int64_t *given = (const volatile int64_t *)(uintptr_t)rows;
  for (long long r = 0; r < nrows; r++) {
    int64_t id = given[r];
    if (id < 0 || id >= span_rows) {
      free(ids);
      PyErr_Format(PyExc_IndexError, "row id %lld out of range [0, %lld)", (long long)id, span_rows);
      return NULL;
    }
    ids[r] = id;
  }
  job_t job = {to_slot, (char *)(uintptr_t)slot, (const uint64_t *)(uintptr_t)layer_ptrs, row_pitch, row_bytes,
               slot_layer_stride, slot_row_stride, ids, nrows, 0, items};
  long long most = bytes / MIN_BYTES_PER_THREAD;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  if (threads > most) threads = most < 1 ? 1 : (int)most;
  /* A scatter that names a row twice writes it twice: on one thread, in order, the last write
   * wins (on several, two threads could write one row at once and leave it torn). */
  int ran = 1;
  Py_BEGIN_ALLOW_THREADS
  if (threads > 1 && !to_slot && repeats(ids, nrows, span_rows) != 0) threads = 1;
  if (threads > 1) {
    ran = run_parallel(&job, threads);
  } else {
    run_job(&job);
  }
  Py_END_ALLOW_THREADS
  free(ids);
  return PyLong_FromLong(ran);
}

static PyObject *kernel(PyObject *self, PyObject *args) {
  (void)self, (void)args;
  return PyUnicode_FromString(stream_name);
}

/* Tests only: the kernels this CPU runs, and making one of them the one in use. */
static PyObject *kernels_here(PyObject *self, PyObject *args) {
  (void)self, (void)args;
  PyObject *out = PyList_New(0);
  for (int k = 0; out != NULL && k < NKERNELS; k++) {
    if (kernel_runs(k)) {
      PyObject *name = PyUnicode_FromString(kernels[k].name);
      if (name == NULL || PyList_Append(out, name) < 0) {
        Py_XDECREF(name);
        Py_DECREF(out);
        return NULL;
      }
      Py_DECREF(name);
    }
  }
  return out;
}

static PyObject *use_kernel(PyObject *self, PyObject *args) {
  (void)self;
  const char *name;
  if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
  for (int k = 0; k < NKERNELS; k++) {
    if (strcmp(name, kernels[k].name) == 0 && kernel_runs(k)) {
      stream_copy = kernels[k].fn, stream_name = kernels[k].name;
      return Py_BuildValue("");
    }
  }
  PyErr_Format(PyExc_ValueError, "no kernel %s on this CPU", name);
  return NULL;
}

static PyObject *set_fail_threads(PyObject *self, PyObject *args) {
  (void)self;
  int fail;
  if (!PyArg_ParseTuple(args, "p", &fail)) return NULL;
  fail_threads = fail;
  return Py_BuildValue("");
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(to_slot, slot, layer_ptrs, nlayers, span_rows, row_pitch, row_bytes, slot_layer_stride,\n"
     "          slot_row_stride, rows, nrows, threads) -> threads that copied\n\n"
     "Copy rows[0..nrows) (int64 ids at address `rows`) of nlayers layers (uint64 base addresses at\n"
     "`layer_ptrs`) to the slot (to_slot) or from it; sizes and strides in bytes. IndexError if a row id\n"
     "is outside [0, span_rows), before anything is copied."},
    {"kernel", kernel, METH_NOARGS, "The copy in use: 'avx-stream', 'sse2-stream' or 'memcpy'."},
    {"_kernels", kernels_here, METH_NOARGS, "Tests only: the kernels this CPU runs, best first."},
    {"_use_kernel", use_kernel, METH_VARARGS, "Tests only: use this kernel (a name from _kernels())."},
    {"_fail_threads", set_fail_threads, METH_VARARGS, "Tests only: start no thread, as if none could be."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowcopy", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__rowcopy(void) {
  pick_copy();
  return PyModule_Create(&module);
}
