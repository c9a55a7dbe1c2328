/*
 * cula._fast_call: packs a C ABI argument struct from torch tensors and calls the entry, in C.
 *
 * Why: a single eager call of a prefill op spends tens of microseconds in Python describing its
 * tensors (dtype, shape, strides, device, address per tensor, struct packing), and at the sizes
 * models run that is a visible share of the call. This module does the same work through the
 * CPython limited API (one abi3 build serves every Python >= 3.10) and links neither torch nor
 * libcula: the entry is called through the address of the function that the ctypes binding
 * already loaded, so one library instance serves both paths.
 *
 * It handles only the common case: every array given is a torch tensor on the CPU or a CUDA
 * device with a dtype cula knows and at most CULA_MAX_DIMS dimensions. Anything else returns
 * None before the entry is called, and the caller falls back to the ctypes packing, which owns
 * the error messages. No validation of shapes or options happens here: the C ABI validates.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "cula/cula.h"

/* The argument structs share one layout: struct_size, the options, a run of tensor pointers and,
 * for the chunked forward, the chunk size. Entries are numbered as in the Python binding. */
enum { KIND_CHUNK_FWD = 0, KIND_DECODE = 1, KIND_CHUNK_BWD = 2, KIND_KDA_GATE = 3, KIND_COUNT = 4 };
#define TENSORS_OF(T, first, last) ((offsetof(T, last) - offsetof(T, first)) / sizeof(cula_tensor*) + 1)
#define MAX_TENSORS 20

typedef struct {
  size_t struct_size;
  size_t first_tensor; /* byte offset of the first tensor pointer */
  size_t num_tensors;
  size_t chunk_size_at; /* 0: none */
} entry_layout;

static const entry_layout LAYOUTS[KIND_COUNT] = {
    {sizeof(cula_chunk_fwd_args), offsetof(cula_chunk_fwd_args, q),
     TENSORS_OF(cula_chunk_fwd_args, q, intermediate_states), offsetof(cula_chunk_fwd_args, chunk_size)},
    {sizeof(cula_decode_args), offsetof(cula_decode_args, q), TENSORS_OF(cula_decode_args, q, final_state_out), 0},
    {sizeof(cula_chunk_bwd_args), offsetof(cula_chunk_bwd_args, q),
     TENSORS_OF(cula_chunk_bwd_args, q, decay), 0},
    {sizeof(cula_kda_gate_args), offsetof(cula_kda_gate_args, g), TENSORS_OF(cula_kda_gate_args, g, g_out), 0},
};

typedef cula_status (*entry_fn)(const void*);

/* Set once by configure(): torch.Tensor, {torch dtype: cula dtype code} and, per entry, its
 * tensor field names in struct order. */
static PyObject* tensor_type = NULL;
static PyObject* dtype_codes = NULL;
static PyObject* field_names[KIND_COUNT];
static PyObject *s_dtype, *s_shape, *s_stride, *s_data_ptr, *s_is_cuda, *s_is_cpu, *s_get_device;

static PyObject* configure(PyObject* self, PyObject* args) {
  PyObject *type, *codes, *fields;
  (void)self;
  if (!PyArg_ParseTuple(args, "OO!O!:configure", &type, &PyDict_Type, &codes, &PyTuple_Type, &fields)) return NULL;
  if (PyTuple_Size(fields) != KIND_COUNT) {
    PyErr_SetString(PyExc_ValueError, "_fast_call.configure: one tuple of field names per entry");
    return NULL;
  }
  for (Py_ssize_t k = 0; k < KIND_COUNT; ++k) {
    PyObject* names = PyTuple_GetItem(fields, k);
    if (!PyTuple_Check(names) || (size_t)PyTuple_Size(names) != LAYOUTS[k].num_tensors) {
      PyErr_Format(PyExc_ValueError, "_fast_call.configure: entry %zd has %zu tensor fields", k,
                   LAYOUTS[k].num_tensors);
      return NULL;
    }
  }
  for (Py_ssize_t k = 0; k < KIND_COUNT; ++k) {
    PyObject* names = PyTuple_GetItem(fields, k);
    Py_INCREF(names);
    Py_XDECREF(field_names[k]);
    field_names[k] = names;
  }
  Py_INCREF(type);
  Py_INCREF(codes);
  Py_XDECREF(tensor_type);
  Py_XDECREF(dtype_codes);
  tensor_type = type;
  dtype_codes = codes;
  Py_RETURN_NONE;
}

/* Reads a sequence of Python ints (torch.Size, tuple) into dst; -1 on error or wrong length. */
static int read_ints(PyObject* seq, int64_t* dst, Py_ssize_t n) {
  if (!PyTuple_Check(seq) || PyTuple_Size(seq) != n) return -1;
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long x = PyLong_AsLongLong(PyTuple_GetItem(seq, i));
    if (x == -1 && PyErr_Occurred()) return -1;
    dst[i] = (int64_t)x;
  }
  return 0;
}

static PyObject* call_noargs(PyObject* obj, PyObject* name) { return PyObject_CallMethodObjArgs(obj, name, NULL); }

/* Describes a torch tensor. 1: done; 0: not the common case (the caller falls back); -1: a
 * Python error is set. */
static int describe(PyObject* x, cula_tensor* t) {
  int result = -1;
  PyObject *dtype = NULL, *shape = NULL, *stride = NULL, *ptr = NULL, *flag = NULL, *dev = NULL;
  int is_tensor = PyObject_IsInstance(x, tensor_type);
  if (is_tensor <= 0) return is_tensor;
  memset(t, 0, sizeof(*t));
  if (!(dtype = PyObject_GetAttr(x, s_dtype))) goto done;
  PyObject* code = PyDict_GetItemWithError(dtype_codes, dtype); /* borrowed */
  if (!code) {
    result = PyErr_Occurred() ? -1 : 0;
    goto done;
  }
  t->dtype = (int32_t)PyLong_AsLong(code);
  if (!(shape = PyObject_GetAttr(x, s_shape))) goto done;
  Py_ssize_t n = PyTuple_Check(shape) ? PyTuple_Size(shape) : -1;
  if (n < 0 || n > CULA_MAX_DIMS) {
    result = 0;
    goto done;
  }
  t->ndim = (int32_t)n;
  if (!(stride = call_noargs(x, s_stride))) goto done;
  if (read_ints(shape, t->shape, n) < 0 || read_ints(stride, t->strides, n) < 0) {
    if (PyErr_Occurred()) goto done;
    result = 0;
    goto done;
  }
  if (!(flag = PyObject_GetAttr(x, s_is_cuda))) goto done;
  if (flag == Py_True) {
    if (!(dev = call_noargs(x, s_get_device))) goto done;
    t->device_type = CULA_CUDA;
    t->device_id = (int32_t)PyLong_AsLong(dev);
  } else {
    Py_DECREF(flag);
    if (!(flag = PyObject_GetAttr(x, s_is_cpu))) goto done;
    if (flag != Py_True) { /* another device: the fallback names it */
      result = 0;
      goto done;
    }
    t->device_type = CULA_CPU;
  }
  if (!(ptr = call_noargs(x, s_data_ptr))) goto done;
  t->data = PyLong_AsVoidPtr(ptr);
  result = PyErr_Occurred() ? -1 : 1;
done:
  Py_XDECREF(dtype);
  Py_XDECREF(shape);
  Py_XDECREF(stride);
  Py_XDECREF(ptr);
  Py_XDECREF(flag);
  Py_XDECREF(dev);
  return result;
}

/* The options tuple in cula_recurrence_options' field order (see _lib.options). */
static int read_options(PyObject* opt, cula_recurrence_options* o) {
  if (!PyTuple_Check(opt) || PyTuple_Size(opt) != 12) {
    PyErr_SetString(PyExc_TypeError, "_fast_call: options must be the 12-tuple of _lib.options");
    return -1;
  }
#define INT_AT(i) ((int32_t)PyLong_AsLong(PyTuple_GetItem(opt, i)))
#define DBL_AT(i) PyFloat_AsDouble(PyTuple_GetItem(opt, i))
  o->family = INT_AT(0);
  o->scale = DBL_AT(1);
  o->use_qk_l2norm = INT_AT(2);
  o->use_gate_in_kernel = INT_AT(3);
  o->safe_gate = INT_AT(4);
  o->has_lower_bound = INT_AT(5);
  o->lower_bound = DBL_AT(6);
  o->use_beta_sigmoid = INT_AT(7);
  o->allow_neg_eigval = INT_AT(8);
  o->state_layout = INT_AT(9);
  o->backend = INT_AT(10);
  o->stream = PyLong_AsVoidPtr(PyTuple_GetItem(opt, 11));
#undef INT_AT
#undef DBL_AT
  return PyErr_Occurred() ? -1 : 0;
}

/* call(kind, entry_address, options, chunk_size, arrays[, segment_len]): arrays maps tensor field
 * names to arrays (a field missing or None stays NULL); segment_len, the chunked forward's. Returns
 * the entry's status as an int, or None when an array is not a torch tensor of the common case
 * (nothing was called). */
static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (!tensor_type) {
    PyErr_SetString(PyExc_RuntimeError, "_fast_call: configure() was not called");
    return NULL;
  }
  if (nargs < 5 || nargs > 6 || !PyDict_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError, "_fast_call.call(kind, entry, options, chunk_size, arrays: dict[, segment_len])");
    return NULL;
  }
  long kind = PyLong_AsLong(args[0]);
  if (kind < 0 || kind >= KIND_COUNT || !field_names[kind]) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_fast_call: entry kind unknown or not configured");
    return NULL;
  }
  const entry_layout* lay = &LAYOUTS[kind];
  PyObject* names = field_names[kind];
  entry_fn entry = (entry_fn)PyLong_AsVoidPtr(args[1]);
  if (!entry) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_fast_call: null entry");
    return NULL;
  }
  /* One buffer for the struct; every argument struct is smaller than this. */
  _Alignas(8) unsigned char buf[512];
  cula_tensor tensors[MAX_TENSORS];
  memset(buf, 0, lay->struct_size);
  *(size_t*)buf = lay->struct_size;
  if (read_options(args[2], (cula_recurrence_options*)(buf + offsetof(cula_chunk_fwd_args, opt))) < 0) return NULL;
  if (lay->chunk_size_at) {
    long cs = PyLong_AsLong(args[3]);
    if (cs == -1 && PyErr_Occurred()) return NULL;
    *(int32_t*)(buf + lay->chunk_size_at) = (int32_t)cs;
  }
  if (nargs == 6) {
    if (kind != KIND_CHUNK_FWD) {
      PyErr_SetString(PyExc_ValueError, "_fast_call: segment_len belongs to the chunked forward");
      return NULL;
    }
    long long seg = PyLong_AsLongLong(args[5]);
    if (seg == -1 && PyErr_Occurred()) return NULL;
    *(int64_t*)(buf + offsetof(cula_chunk_fwd_args, segment_len)) = (int64_t)seg;
  }
  const cula_tensor** fields = (const cula_tensor**)(buf + lay->first_tensor);
  for (size_t i = 0; i < lay->num_tensors; ++i) {
    PyObject* x = PyDict_GetItemWithError(args[4], PyTuple_GetItem(names, (Py_ssize_t)i)); /* borrowed */
    if (!x) {
      if (PyErr_Occurred()) return NULL;
      continue;
    }
    if (x == Py_None) continue;
    int r = describe(x, &tensors[i]);
    if (r < 0) return NULL;
    if (r == 0) Py_RETURN_NONE;
    fields[i] = &tensors[i];
  }
  cula_status status;
  Py_BEGIN_ALLOW_THREADS
  status = entry(buf);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong((long)status);
}

static PyMethodDef METHODS[] = {
    {"configure", (PyCFunction)configure, METH_VARARGS,
     "configure(torch.Tensor, {dtype: code}, (tensor field names per entry, in struct order))"},
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL,
     "call(kind, entry, options, chunk_size, arrays[, segment_len]) -> status, or None to fall back"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_fast_call", NULL, -1, METHODS, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fast_call(void) {
  _Static_assert(sizeof(cula_chunk_fwd_args) <= 512 && sizeof(cula_chunk_bwd_args) <= 512, "buffer too small");
  _Static_assert(offsetof(cula_chunk_fwd_args, opt) == offsetof(cula_decode_args, opt) &&
                     offsetof(cula_chunk_fwd_args, opt) == offsetof(cula_chunk_bwd_args, opt) &&
                     offsetof(cula_chunk_fwd_args, opt) == offsetof(cula_kda_gate_args, opt),
                 "options at one offset in every argument struct");
  _Static_assert(TENSORS_OF(cula_chunk_bwd_args, q, decay) <= MAX_TENSORS, "MAX_TENSORS");
#define INTERN(var, text) \
  if (!(var = PyUnicode_InternFromString(text))) return NULL;
  INTERN(s_dtype, "dtype")
  INTERN(s_shape, "shape")
  INTERN(s_stride, "stride")
  INTERN(s_data_ptr, "data_ptr")
  INTERN(s_is_cuda, "is_cuda")
  INTERN(s_is_cpu, "is_cpu")
  INTERN(s_get_device, "get_device")
#undef INTERN
  return PyModule_Create(&MODULE);
}
